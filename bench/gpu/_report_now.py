"""A pytest plugin for the GPU runbook's kernel tests: each failure's traceback is written to the
output as soon as the test ends (pytest prints them only at the end of the session, which a run
stopped at its time limit never reaches). Loaded by `bench/gpu/kernel_tests.py` with
`-p bench.gpu._report_now`."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n---- {report.nodeid} ({report.when}) failed:\n{report.longreprtext[-4000:]}\n----", flush=True)
