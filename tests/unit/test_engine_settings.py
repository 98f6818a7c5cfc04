"""Engine defaults are written once (core/engine_api) and read everywhere else."""

from __future__ import annotations

import inspect

from batchmlx.cli.batch_commands import submit
from batchmlx.cli.serving import serve, worker
from batchmlx.core.engine_api import ENGINE_DEFAULTS, EngineSettings
from batchmlx.core.scheduler import SchedulerConfig


def test_running_bound_is_one_in_simple_mode() -> None:
    assert EngineSettings(max_batch_size=8).running_bound == 8
    assert EngineSettings(simple=True, max_batch_size=8).running_bound == 1


def test_scheduler_and_cli_take_their_defaults_from_engine_settings() -> None:
    sched = SchedulerConfig()
    assert sched.max_batch_size == ENGINE_DEFAULTS.max_batch_size
    assert sched.block_size == ENGINE_DEFAULTS.block_size
    assert sched.max_prefill_tokens == ENGINE_DEFAULTS.max_prefill_tokens
    for command in (worker, serve, submit):
        default = inspect.signature(command).parameters["max_batch_size"].default
        assert default == ENGINE_DEFAULTS.max_batch_size, command.__name__


def test_cli_engine_commands_take_the_adaptive_width_default() -> None:
    for command in (worker, serve):
        default = inspect.signature(command).parameters["adaptive_width"].default
        assert default is ENGINE_DEFAULTS.adaptive_width, command.__name__
