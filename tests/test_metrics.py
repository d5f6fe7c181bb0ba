import io
import random
import threading
import time

import pytest

from spmd import metrics


@pytest.fixture(autouse=True)
def _fresh():
    metrics.reset()
    yield
    metrics.reset()


def test_counter():
    c = metrics.counter("test.hits")
    assert metrics.counter("test.hits") is c
    c.inc()
    c.inc(4)
    assert c.value == 5
    assert metrics.snapshot()["counters"]["test.hits"] == 5


@pytest.mark.parametrize("make", [metrics.counter, metrics.timer])
@pytest.mark.parametrize("name, err, msg", [(3, TypeError, "got int 3"), (None, TypeError, "got NoneType None"),
                                            (["a"], TypeError, "got list"), ("", ValueError, "got ''")])
def test_bad_names_are_rejected_and_leave_report_working(make, name, err, msg):
    with pytest.raises(err, match=f"name: expected a non-empty str, {msg}"):
        make(name)
    make("test.ok")
    assert isinstance(metrics.report(), str)
    assert all(isinstance(n, str) for n in metrics.snapshot()["counters"])


def test_percentiles_on_known_samples():
    t = metrics.timer("test.known")
    samples = [i / 1000 for i in range(1, 101)]  # 1ms .. 100ms
    random.shuffle(samples)
    for s in samples:
        t.record(s)
    p = t.percentiles()
    assert list(p) == [1, 5, 10, 20, 50, 80, 90, 95, 99]
    # Linear interpolation at rank p/100 * 99 over 1..100 ms gives 1 + 0.99 p ms.
    for q, v in p.items():
        assert v == pytest.approx((1 + 0.99 * q) / 1000), q
    assert t.total_samples == 100
    assert t.accumulator_s == pytest.approx(sum(samples))


def test_reservoir_keeps_last_samples():
    t = metrics.timer("test.reservoir")
    for _ in range(2000):
        t.record(1.0)
    for _ in range(metrics.RESERVOIR_SIZE):
        t.record(3.0)
    assert t.percentiles()[1] == 3.0
    assert t.total_samples == 2000 + metrics.RESERVOIR_SIZE


def test_context_manager_nested_and_rate():
    t = metrics.timer("test.ctx")
    with t:
        with metrics.timer("test.ctx"):
            time.sleep(0.002)
        time.sleep(0.002)
    assert t.total_samples == 2
    inner, outer = sorted(t.percentiles()[q] for q in (1, 99))
    assert inner >= 0.002 and outer >= 0.004 and outer > inner
    assert t.rate() > 0


def test_threads():
    c = metrics.counter("test.threads")
    t = metrics.timer("test.threads")

    def work():
        for _ in range(2000):
            c.inc()
            t.record(1e-6)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert c.value == 8000 and t.total_samples == 8000


def test_report_format():
    metrics.counter("test.cache_hit").inc(2)
    t = metrics.timer("test.execute")
    for s in (0.001, 0.002, 0.003):
        t.record(s)
    text = metrics.report()
    block = text[text.index("Metric: test.execute"):].splitlines()
    assert block[1] == "  TotalSamples: 3"
    assert block[2] == "  Accumulator: 6.000ms"
    assert block[3].startswith("  Rate: ") and block[3].endswith(" / second")
    assert block[4].startswith("  Percentiles: 1%=1.020ms; 5%=1.100ms; ")
    assert block[4].endswith("99%=2.980ms")
    assert "Counter: test.cache_hit\n  Value: 2\n" in text


def test_reset_keeps_references_working():
    c = metrics.counter("test.reset")
    t = metrics.timer("test.reset_t")
    c.inc()
    t.record(1.0)
    metrics.reset()
    assert c.value == 0 and t.total_samples == 0 and t.percentiles() == {}
    assert "test.reset_t" not in metrics.snapshot()["timers"]
    c.inc()
    assert metrics.snapshot()["counters"]["test.reset"] == 1


def test_format_seconds():
    assert metrics.format_seconds(1.5) == "1.500s"
    assert metrics.format_seconds(0.0123) == "12.300ms"
    assert metrics.format_seconds(4e-6) == "4.000us"


def test_hot_path_is_cheap():
    c = metrics.counter("test.cheap")
    t = metrics.timer("test.cheap_t")
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        c.inc()
        t.record(1e-6)
    per_call_us = (time.perf_counter() - start) / (2 * n) * 1e6
    assert per_call_us < 20, per_call_us  # about 1 us; loose bound for loaded machines


def test_print_report_with_rich():
    from rich.console import Console

    metrics.timer("test.rich").record(0.5)
    metrics.counter("test.rich_c").inc()
    out = io.StringIO()
    metrics.print_report(Console(file=out, width=200))
    assert "test.rich" in out.getvalue() and "500.000ms" in out.getvalue()
