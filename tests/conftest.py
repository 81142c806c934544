"""Shared test set-up: offline, and one CPU thread (the test models are tiny: extra threads only
add spin-wait overhead, badly so when the 2 cores are shared), also in the processes the tests
start (the app, the training commands, the interpreter scripts) through OMP_NUM_THREADS."""
import os
import tempfile
from pathlib import Path
from typing import Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def _share_default_ssl_context() -> None:
    """One default SSL context per process for httpx. gradio_client opens new httpx clients for
    nearly every request (config, API info, each predict and its stream), and each built a fresh
    context, parsing the CA bundle again: ~0.1 s of CPU a time, over 1,000 times in
    test_hardening.py alone. The tests talk plain HTTP to 127.0.0.1, so the context is never used
    for a handshake; contexts with other arguments are built as before."""
    try:
        import httpx._transports.default as transports
    except ImportError:
        return
    build = transports.create_ssl_context
    shared: dict = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = build(verify=verify, cert=cert, trust_env=trust_env)
        return shared[trust_env]
    transports.create_ssl_context = create_ssl_context


_share_default_ssl_context()


# Seconds each long test file takes on the 2-core CPU machine under `-n 2 --dist loadfile`
# (pytest --durations=0, setup included; test_triton_compile.py with Triton's compile cache cold, as
# in CI); files not listed take under 10 s. Only their order matters: see
# pytest_collection_modifyitems.
FILE_SECONDS = {
    "test_browser.py": 135, "test_sampling_power.py": 113, "test_hardening.py": 56, "test_whatif.py": 47,
    "test_triton_compile.py": 55, "test_cuda_w4.py": 46, "test_triton_w4.py": 33, "test_oracle_acceptance.py": 30,
    "test_accessibility.py": 27, "test_gguf.py": 26, "test_train_stack.py": 23, "test_app.py": 20, "test_fused.py": 18, "test_decoding.py": 15,
    "test_ui_whatif.py": 12, "test_engine_bench.py": 10, "test_train.py": 9, "test_greedy_oracle.py": 8,
}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long statistical runs, opt-in: pytest -m slow")
    config.addinivalue_line("markers", "quiet: judges wall time; runs while the other workers wait (cpu_turn)")
    # xdist hands out files in the collection order below, not by their number of tests
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_finish(session) -> None:
    """Every test module is imported now (torch, transformers, gradio, plotly: ~500k objects that
    live as long as the process): freeze them out of the cyclic garbage collector, so that each
    full collection (whatif's before every timed run, pytest's five at the end) scans only what the
    tests made since, ~0.5 s less each. Nothing frozen was garbage: a collection runs first."""
    import atexit
    import gc
    gc.collect()
    gc.freeze()
    # back to the collector as the interpreter exits, after pytest's own last collections (nanobind
    # reports frozen objects of its bindings as leaks otherwise)
    atexit.register(gc.unfreeze)


@pytest.fixture(scope="module", autouse=True)
def _freeze_module_survivors():
    """The same at the start of every test module: what earlier modules left alive (a Gradio app
    keeps ~400k objects) is frozen too, so that the collections of the modules after it (automatic
    ones, whatif's, Gradio's many small allocations) do not scan it again and again (test_ui_whatif.py
    after test_app.py: 23 s -> 15 s). A collection runs first, so no garbage is frozen; objects
    frozen here that die later are freed by reference counting as usual, and only a reference cycle
    among them would wait for the exit's unfreeze."""
    import gc
    gc.collect()
    gc.freeze()
    yield


def pytest_collection_modifyitems(config, items) -> None:
    """Longest files first (FILE_SECONDS), the rest in their usual order: with --dist loadfile
    each worker takes whole files as it frees up, so a long file handed out last would run alone
    at the end. Slow tests run only when the -m expression names them."""
    rank = {name: i for i, name in enumerate(sorted(FILE_SECONDS, key=lambda n: -FILE_SECONDS[n]))}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))     # stable: a file's tests keep their order
    if "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _turn_files(config) -> Optional[tuple[Path, Path]]:
    """The two lock files the workers of one xdist run share (None outside xdist: one process)."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    uid = workerinput["testrunuid"]      # the run's id, the same in every worker (pytest-xdist)
    base = Path(tempfile.gettempdir()) / f"hierviz-cpu-turn-{uid}"
    return base.with_suffix(".gate"), base.with_suffix(".cpu")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """cpu_turn: a test marked quiet (it judges wall time: a replay's pace, a run's time left) has the
    2 cores to itself. It waits for the other worker's test to end, and the other worker waits at
    its next test until it is done; the other tests share the CPU. Around the whole
    protocol, so that module fixtures set up or torn down with a test are inside its turn, and the
    wait is outside pytest-timeout's 300 s. The gate keeps the shared holders from starving one that
    waits for its turn: a worker passes it before taking its share, and one that waits holds it."""
    files = _turn_files(item.config)
    if files is None:
        yield
        return
    import fcntl
    gate, cpu = (open(f, "a") for f in files)
    try:
        quiet = item.get_closest_marker("quiet") is not None
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(cpu, fcntl.LOCK_EX if quiet else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield
    finally:
        gate.close()
        cpu.close()                      # closing drops the lock
