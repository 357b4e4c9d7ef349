"""Health checks: what a node runs before it joins a round, to stay out when it is bad.

Before each round it joins, a node runs its ``--health-check`` list in order, each within
``--health-check-timeout``: shell commands (healthy when they exit 0) and rallypoint's
``builtin:`` checks (``_builtin_checks``). The first failing check keeps the node out:
:meth:`HealthChecks.run` raises :class:`UnhealthyNodeError` whose message is the screen,
and ``rallypoint run`` exits with ``EXIT_UNHEALTHY``. A check that cannot run here is
skipped, said once; every result is a ``health`` event in ``--events``.
"""

from __future__ import annotations

import signal

from rallypoint._elastic._errors import UnhealthyNodeError
from rallypoint._elastic._exits import EXIT_UNHEALTHY
from rallypoint._elastic._health._builtin_checks import run_builtin
from rallypoint._elastic._health._check_run import CheckResult, HealthContext, run_command
from rallypoint._elastic._options import HealthOptions
from rallypoint._supervise._output import write_console
from rallypoint._watch._observer import Observer

__all__ = ["HealthChecks", "screen"]

TAIL_LINES = 10
"""Lines of a failed check's output shown on the screen."""


class HealthChecks:
    """This node's checks; :meth:`run` before each round it joins."""

    def __init__(self, options: HealthOptions, context: HealthContext, observer: Observer) -> None:
        self.options = options
        self.context = context
        self.observer = observer
        self._said: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.options.checks)

    def run(self, round: int) -> None:
        """Run every check in order; raises :class:`UnhealthyNodeError` at the first failure."""
        for check in self.options.checks:
            result = self._one(check.strip())
            self.observer.emit(
                "health",
                round=round,
                check=check,
                ok=result.ok,
                seconds=round_seconds(result.seconds),
                exitcode=result.exitcode,
                timed_out=result.timed_out,
                skipped=result.skipped or None,
            )
            if result.skipped and check not in self._said:
                self._said.add(check)
                write_console(
                    2, f"rallypoint: health check {check} skipped: {result.skipped}\n".encode()
                )
            if not result.ok:
                raise UnhealthyNodeError(screen(result, self.options), check=check)

    def _one(self, check: str) -> CheckResult:
        timeout = self.options.timeout.total_seconds()
        if check.startswith("builtin:"):
            return run_builtin(check, self.context, timeout)
        return run_command(check, timeout, poll=self.context.poll, env=self.context.env)


def round_seconds(seconds: float) -> float:
    return float(f"{seconds:.3g}")


def screen(result: CheckResult, options: HealthOptions) -> str:
    """What a failed check shows: the check, its exit code or timeout, its last lines."""
    if result.timed_out:
        limit = options.timeout.total_seconds()
        how = f"timed out after {limit:g} s (--health-check-timeout); killed"
    elif result.exitcode is not None:
        how = f"exit code {result.exitcode}"
        if result.exitcode < 0:
            how = f"killed by {signal.Signals(-result.exitcode).name}"
    else:
        how = "failed"
    lines = [f"rallypoint: health check failed: {result.check}", f"  {how}"]
    tail = [line for line in result.output.rstrip().splitlines() if line.strip()][-TAIL_LINES:]
    if tail:
        lines.append("  last lines of its output:")
        lines += [f"    {line}" for line in tail]
    else:
        lines.append("  (it printed nothing)")
    lines.append(
        f"rallypoint: this node stays out of the job; exit code {EXIT_UNHEALTHY} (unhealthy): "
        "replace the node (docs/multinode.md, Bad nodes)"
    )
    return "\n".join(lines)
