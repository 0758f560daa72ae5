"""The profiler's steps of a run (`profile_start`, `profile_steps`): torch.profiler around
optimizer steps profile_start + 1 .. profile_start + profile_steps, then each rank's Chrome trace
in RUN_DIR/profile and rank 0's table on stderr; a run that stops or ends inside those steps
writes what was profiled."""

from __future__ import annotations

import sys
from pathlib import Path


class StepProfiler:
    def __init__(self, run):
        self.run, self.profiled = run, None
        self.first = run.cfg.profile_start + 1
        self.end = run.cfg.profile_start + run.cfg.profile_steps  # the last step profiled

    def before_step(self) -> None:
        if self.run.cfg.profile_start and self.run.step == self.run.cfg.profile_start:
            from launch.profiling import Profiled

            self.profiled = Profiled(self.run.engine.device.type == "cuda")
            self.profiled.__enter__()

    def after_step(self, trained: bool) -> None:
        """After `train_step`, before the step is counted: the last profiled step, or a step a
        stop request gave up, ends the profile."""
        if self.profiled is None:
            return
        if not trained:
            self._write(last=self.run.step)
        elif self.run.step + 1 == self.end:
            self._write(last=self.run.step + 1)

    def close(self) -> None:
        if self.profiled is not None:
            self._write(last=self.run.step)

    def _write(self, last: int) -> None:
        profiled, self.profiled = self.profiled, None
        profiled.__exit__(None, None, None)
        steps = f"{self.first}-{last}" if last > self.first else str(self.first)
        run = self.run
        trace = Path(run.cfg.run_dir) / "profile" / f"trace_rank{run.denv.rank}_steps{steps}.json"
        profiled.export(trace)
        if run.denv.is_main:
            print(
                profiled.summary(f"optimizer steps {steps} (rank 0)", host_ops=15), file=sys.stderr
            )
            print(
                f"profile: Chrome traces in {trace.parent} (chrome://tracing, ui.perfetto.dev)",
                file=sys.stderr,
            )
