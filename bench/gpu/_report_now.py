"""A pytest plugin for the GPU runbook's kernel tests: each failure's traceback is written to the
output as soon as the test ends (pytest prints them only at the end of the session, which a run
stopped at its time limit never reaches). Loaded by `bench/gpu/kernel_tests.py` with
`-p _report_now` (bench/gpu on PYTHONPATH)."""

_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config is not None else None
    if report.failed and terminal is not None:
        terminal.write_line(f"\n---- {report.nodeid} ({report.when}) failed:\n{report.longreprtext[-4000:]}\n----")
