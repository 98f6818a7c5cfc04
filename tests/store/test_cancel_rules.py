"""Cancel's rules on a real store (both dialects): what OpenAI answers for each status
(llama-stack tests/integration/batches test_batch_cancel_completed: 409 "Cannot cancel a batch
with status 'completed'.", the same for failed; a cancelled batch may be cancelled again)."""

from __future__ import annotations

import pytest

from batchmlx.batches.errors import BatchError, CannotCancel
from batchmlx.batches.lifecycle import cancel
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store

from .conftest import add_batch, batch


@pytest.mark.parametrize(
    "status",
    [BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.FINALIZING],
)
def test_an_ended_batch_cannot_be_cancelled(with_store, status):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("b1", status=status))
        with pytest.raises(CannotCancel) as exc:
            await cancel(store, "b1", now=2000)
        assert str(exc.value) == f"Cannot cancel a batch with status '{status.value}'."
        assert exc.value.status == status.value and isinstance(exc.value, BatchError)
        assert (await store.get_batch("b1")).status is status  # untouched

    with_store(scenario)


@pytest.mark.parametrize("status", [BatchStatus.CANCELLING, BatchStatus.CANCELLED])
def test_a_cancelled_batch_is_returned_as_it_is(with_store, status):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("b1", status=status))
        assert (await cancel(store, "b1", now=2000)).status is status

    with_store(scenario)
