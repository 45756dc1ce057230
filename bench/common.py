"""Shared machinery of the kernel microbenchmarks: timing, the bandwidth floor, the record, tables.

A benchmark module describes its work as `Case`s (one shape, one peer, a builder returning the
callable to time, the bytes its floor must move) and uses this module twice:
- under pytest-benchmark (`pytest bench --benchmark-only`): `run_in_pytest(benchmark, case)` per
  parametrized test, peers grouped by shape; the medians below go to `extra_info` and the peer
  table is printed at the end of the session (see bench/conftest.py);
- as a script: `main(name, description, cases_for)` times every case, prints the peer table and
  writes JSON.

Timing: on CUDA, `CALLS_PER_REPLAY` calls are captured into one CUDA graph and each replay is timed
with events, so launch overhead is excluded; on the CPU, plain wall-clock per call. Both report the
median with min and max. The floor column is the case's bytes at the device-to-device copy bandwidth
measured in the same run.
"""

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

CALLS_PER_REPLAY = 10
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Case:
    """One timed thing: `build()` prepares inputs (untimed) and returns the callable to time."""

    shape: str
    peer: str
    build: Callable[[], Callable[[], object]]
    floor_bytes: int


@dataclass
class Record:
    """The outcome of one case, in microseconds per call; `error` is set when the peer failed."""

    shape: str
    peer: str
    median_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    floor_us: float | None = None
    error: str | None = None


def bench_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Prepares `fn` for repeated timing (warm-up, and on CUDA a captured graph).

    `capture=False` times each eager call with CUDA events instead, for callables that cannot be
    captured (they replay graphs of their own, e.g. a compiled model or the model runner); launch
    overhead is then included wherever the host does not stay ahead of the device. `reset`, for
    eager timing only, runs before every call, untimed: it restores state a call changes (a cache
    length), so that repeated calls do the same work.
    """

    def __init__(
        self,
        fn: Callable[[], object],
        device: torch.device,
        warmup: int = 3,
        *,
        capture: bool = True,
        reset: Callable[[], object] | None = None,
    ):
        self.device = device
        self.fn = fn
        self.reset = reset
        self.graph = None
        if device.type != "cuda" or not capture:
            for _ in range(warmup):
                self._call()
            sync(self.device)
            return
        if reset is not None:
            raise ValueError("reset needs capture=False on CUDA: a captured graph would time it")
        # Warm up on a side stream (compilation, autotuning, allocator), as graph capture requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(CALLS_PER_REPLAY):
                fn()
        self.run()

    def _call(self) -> None:
        if self.reset is not None:
            self.reset()
        self.fn()

    def run(self) -> None:
        """One timed unit, finished: a graph replay (CALLS_PER_REPLAY calls) or one eager call."""
        if self.graph is None:
            self._call()
        else:
            self.graph.replay()
        sync(self.device)

    @property
    def calls_per_run(self) -> int:
        return 1 if self.graph is None else CALLS_PER_REPLAY

    def measure(self, reps: int) -> tuple[float, float, float]:
        """(median, min, max) microseconds per call over `reps` timed units."""
        if self.device.type != "cuda":
            samples = []
            for _ in range(reps):
                if self.reset is not None:
                    self.reset()
                start = time.perf_counter()
                self.fn()
                samples.append((time.perf_counter() - start) * 1e6)
            return statistics.median(samples), min(samples), max(samples)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(reps)
        ]
        for start, end in events:
            if self.graph is None and self.reset is not None:
                self.reset()
            start.record()
            if self.graph is None:
                self.fn()
            else:
                self.graph.replay()
            end.record()
        sync(self.device)
        samples = [start.elapsed_time(end) * 1e3 / self.calls_per_run for start, end in events]
        return statistics.median(samples), min(samples), max(samples)


@cache
def copy_bandwidth(device_str: str) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written), measured now."""
    device = torch.device(device_str)
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    median_us, _, _ = Timer(lambda: target.copy_(source), device).measure(reps=10)
    return 2 * nbytes / (median_us * 1e-6)


@cache
def matmul_rate(device_str: str) -> float:
    """Matrix-product rate in FLOP/s, measured now on random data: bf16 8192^3 on CUDA (the
    machine's arithmetic ceiling), fp32 512^3 elsewhere."""
    device = torch.device(device_str)
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    generator = torch.Generator(device).manual_seed(0)
    a, b = (
        torch.randn(size, size, dtype=dtype, device=device, generator=generator) for _ in range(2)
    )
    out = torch.empty_like(a)
    median_us, _, _ = Timer(lambda: torch.mm(a, b, out=out), device).measure(reps=10)
    return 2 * size**3 / (median_us * 1e-6)


def floor_us(nbytes: int, device: torch.device) -> float:
    """Time to move `nbytes` at the measured copy bandwidth."""
    return nbytes / copy_bandwidth(str(device)) * 1e6


def _package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    """The host CPU's model name (Linux's /proc/cpuinfo, else `platform.processor()`): CPU figures
    from two machines differ by more than any change measured on one."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or "unknown"
    if "cpu family" not in fields or "model" not in fields:
        return fields["model name"]
    return f"{fields['model name']} (family {fields['cpu family']}, model {fields['model']})"


def environment(device: torch.device) -> dict:
    """What the numbers were measured on: GPU, versions, date, measured bandwidth."""
    info = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "sm_count": (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else None
        ),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "transformers": _package_version("transformers"),
        "flash_attn": _package_version("flash-attn"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    if copy_bandwidth.cache_info().currsize:
        info["copy_bandwidth_GBps"] = round(copy_bandwidth(str(device)) / 1e9, 1)
    if matmul_rate.cache_info().currsize:
        info["matmul_TFLOPs"] = round(matmul_rate(str(device)) / 1e12, 3)
    return info


def describe_error(error: BaseException) -> str:
    """`Type: first line of the message`, how a failing peer is recorded."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first_line}"


def _time_case(case: Case, device: torch.device, reps: int) -> tuple[Record, Timer | None]:
    """Time one case; a peer that fails to build or run gives a record with its error, no timer."""
    record = Record(case.shape, case.peer, floor_us=floor_us(case.floor_bytes, device))
    try:
        timer = Timer(case.build(), device)
    except Exception as error:  # a failing peer is a result (e.g. a compile error), not a crash
        record.error = describe_error(error)
        return record, None
    record.median_us, record.min_us, record.max_us = timer.measure(reps)
    return record, timer


def run_case(case: Case, device: torch.device, reps: int) -> Record:
    return _time_case(case, device, reps)[0]


SESSION_RECORDS: list[Record] = []


def run_in_pytest(benchmark, case: Case, reps: int = 20) -> Record:
    """Body of a pytest-benchmark test: peers of a shape share a group; medians go to extra_info.

    pytest-benchmark's own rounds time whole units (a synchronized graph replay of
    CALLS_PER_REPLAY calls on CUDA); the per-call figures are in extra_info. A failing peer is
    skipped with its error and still appears in the peer table printed at the end.
    """
    import pytest

    benchmark.group = case.shape
    record, timer = _time_case(case, bench_device(), reps)
    SESSION_RECORDS.append(record)
    if timer is None:
        pytest.skip(f"{case.peer} on {case.shape}: {record.error}")
    benchmark.extra_info.update(asdict(record), calls_per_round=timer.calls_per_run)
    benchmark.pedantic(timer.run, rounds=reps, warmup_rounds=1)
    return record


def _cell(record: Record) -> str:
    if record.error is not None:
        return f"fails ({record.error.split(':')[0]})"
    return f"{record.median_us:.1f} ({record.min_us:.1f}-{record.max_us:.1f})"


def format_peer_table(records: Sequence[Record]) -> str:
    """A markdown table: one row per shape, the floor, then each peer's median (min-max) in us."""
    shapes = list(dict.fromkeys(record.shape for record in records))
    peers = list(dict.fromkeys(record.peer for record in records))
    cells = {(record.shape, record.peer): record for record in records}
    lines = [
        "| shape | floor us | " + " | ".join(f"{peer} us" for peer in peers) + " |",
        "|---" * (len(peers) + 2) + "|",
    ]
    for shape in shapes:
        floor = next(cells[shape, peer].floor_us for peer in peers if (shape, peer) in cells)
        row = [_cell(cells[shape, peer]) if (shape, peer) in cells else "-" for peer in peers]
        lines.append(f"| {shape} | {floor:.1f} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def format_case_row(record: Record) -> str:
    """One finished case as a markdown row of `CASE_HEADER`, printed as soon as it is timed."""
    return f"| {record.shape} | {record.peer} | {_cell(record)} | {record.floor_us:.1f} |"


CASE_HEADER = "| shape | peer | us median (min-max) | floor us |\n|---|---|---|---|"


def main(name: str, description: str, cases_for: Callable[[torch.device, bool], list[Case]]):
    """Script entry point: time `cases_for(device, quick)` printing each case's row as it
    finishes (a run cut short still shows what it measured), then the peer table; write the
    JSON."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--json", type=Path, default=None, help=f"default: results/{name}.json")
    args = parser.parse_args()
    device = bench_device()
    reps = 10 if args.quick else 50
    print(f"{description} on {device}", flush=True)
    print(CASE_HEADER, flush=True)
    records = []
    for case in cases_for(device, args.quick):
        records.append(run_case(case, device, reps))
        print(format_case_row(records[-1]), flush=True)
    env = environment(device)
    print(f"{description} on {env['gpu'] or 'CPU'} ({env['date']})")
    print(f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}")
    print(f"floor: bytes at the measured copy bandwidth of {env['copy_bandwidth_GBps']} GB/s")
    print(format_peer_table(records))
    write_results(
        args.json or RESULTS_DIR / f"{name}.json", name, env, [asdict(r) for r in records]
    )
    return records


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on `device`: benchmarks draw their random inputs where they run (drawing
    gigabytes on the host and copying them over would take longer than the timing)."""
    return torch.Generator(device).manual_seed(seed)


def write_results(path: Path, benchmark: str, env: dict, results: list, **extra) -> None:
    """Write a benchmark's JSON record (name, environment, anything in `extra`, results)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": benchmark, "environment": env, **extra, "results": results}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
