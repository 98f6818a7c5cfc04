"""A local https server for fetch tests, on loopback only, with a certificate made here: a CA
of its own (trusted by `client_context()` alone, never by the system) signs a leaf for
localhost, images.test and 127.0.0.1.

Paths: /ok (a small body), /trickle (headers, then a body byte every `TRICKLE_S`), /slow-head
(the status line a byte at a time), /to-http (302 to an http URL), /to-ok (302 to /ok),
/loop (302 to itself), /big (a Content-Length past any limit), /secret (404 with a body that
must never reach an error message), and the `files` it is given (path -> body, type)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import threading
import time
from pathlib import Path

TRICKLE_S = 0.2
BODY = b"\x89PNG fake image bytes"
SECRET = b"SECRET-INTERNAL-ANSWER"


def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """(CA certificate, leaf certificate, leaf key) as PEM files in `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "batchmlx test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.DNSName("images.test"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]  # fmt: skip
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    paths = folder / "ca.pem", folder / "leaf.pem", folder / "leaf.key"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(leaf.public_bytes(pem))
    paths[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return paths


class HttpsServer:
    """Serves the paths above on 127.0.0.1 (one thread per connection) until `close`."""

    def __init__(
        self,
        folder: Path,
        trickle_for_s: float = 30.0,
        files: dict[str, tuple[bytes, str]] | None = None,
        trickle_s: float = TRICKLE_S,
    ) -> None:
        self.ca, leaf, key = make_certs(folder)
        self.files = files or {}
        self.trickle_s = trickle_s
        self.trickle_for_s = trickle_for_s
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(leaf, key)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.05)  # the accept loop sees `close` at once
        self.port = self._sock.getsockname()[1]
        self.hits: list[str] = []  # request lines' paths, in order
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"https://{host}:{self.port}{path}"

    def client_context(self) -> ssl.SSLContext:
        """A client context that trusts this server's CA (and nothing else): tests only."""
        return ssl.create_default_context(cafile=str(self.ca))

    def close(self) -> None:
        self._closed.set()
        self._accept.join(5)
        self._sock.close()
        for t in self._threads:
            t.join(5)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            t = threading.Thread(target=self._one, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _one(self, raw: socket.socket) -> None:
        try:
            with self._ctx.wrap_socket(raw, server_side=True) as conn:
                conn.settimeout(5)
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                path = head.split(b" ", 2)[1].decode()
                self.hits.append(path)
                self._answer(conn, path)
        except (OSError, ssl.SSLError):
            return

    def _answer(self, conn: ssl.SSLSocket, path: str) -> None:
        def send(status: str, headers: dict[str, str], body: bytes = b"") -> None:
            lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()),
                     "Connection: close", "", ""]  # fmt: skip
            conn.sendall("\r\n".join(lines).encode() + body)

        if path in self.files:
            body, kind = self.files[path]
            send("200 OK", {"Content-Type": kind, "Content-Length": str(len(body))}, body)
        elif path == "/ok":
            send("200 OK", {"Content-Type": "image/png", "Content-Length": str(len(BODY))}, BODY)
        elif path == "/to-http":
            send("302 Found", {"Location": f"http://127.0.0.1:{self.port}/ok",
                               "Content-Length": "0"})  # fmt: skip
        elif path == "/to-ok":
            send("302 Found", {"Location": "/ok", "Content-Length": "0"})
        elif path == "/loop":
            send("302 Found", {"Location": "/loop", "Content-Length": "0"})
        elif path == "/big":
            send("200 OK", {"Content-Type": "image/png", "Content-Length": str(10**12)})
        elif path == "/secret":
            send("404 Not Found", {"Content-Length": str(len(SECRET))}, SECRET)
        elif path == "/slow-head":
            self._trickle(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" * 1000)
        elif path == "/trickle":
            send("200 OK", {"Content-Type": "image/png", "Content-Length": "1000000"})
            self._trickle(conn, b"\0" * 1_000_000)
        else:
            send("404 Not Found", {"Content-Length": "0"})

    def _trickle(self, conn: ssl.SSLSocket, data: bytes) -> None:
        end = time.monotonic() + self.trickle_for_s
        for i in range(len(data)):
            if self._closed.is_set() or time.monotonic() > end:
                return
            conn.sendall(data[i : i + 1])
            time.sleep(self.trickle_s)
