"""The online routes' JSON response (server/bodies.FastJSONResponse): the same JSON as
starlette's encoder gives, for the values the worker's bodies hold."""

from __future__ import annotations

import json

import numpy as np
from starlette.responses import JSONResponse

from batchmlx.formats.embeddings import EncodingFormat, embeddings_body
from batchmlx.server.bodies import FastJSONResponse


def test_it_encodes_what_starlettes_encoder_does():
    vectors = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    body = embeddings_body(vectors=vectors.tolist(), model="m", prompt_tokens=7,
                           encoding=EncodingFormat.FLOAT)  # fmt: skip
    body["extra"] = {"score": np.float64(0.25), "ids": (1, 2), "text": "é"}
    fast = json.loads(FastJSONResponse(body).body)
    plain = {**body, "extra": {**body["extra"], "score": 0.25}}
    assert fast == json.loads(JSONResponse(plain).body)
    assert fast["data"][2]["embedding"] == [float(x) for x in vectors[2]]
