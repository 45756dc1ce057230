"""pytest-benchmark hooks shared by every microbenchmark module in bench/.

The JSON of `--benchmark-json` gets the GPU, versions and measured bandwidth in `machine_info`;
the session ends with the peer table of every case that ran (see bench/common.py).
"""

from common import SESSION_RECORDS, bench_device, environment, format_peer_table


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["specdec_bench"] = environment(bench_device())


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not SESSION_RECORDS:
        return
    env = environment(bench_device())
    terminalreporter.write_sep("=", f"peer table ({env['gpu'] or 'CPU'}), microseconds per call")
    terminalreporter.write_line(format_peer_table(SESSION_RECORDS))
