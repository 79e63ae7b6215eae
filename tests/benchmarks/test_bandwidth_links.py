"""The bandwidth benchmark's link names (benchmarks/bandwidth_sites.py ``Link``): rate, and a worker
link's delay after ``+``; a row's ``link`` is the name, so a delayed link's rows never merge with an
undelayed one's."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bandwidth_sites import Link  # noqa: E402


@pytest.mark.parametrize("text, rate, delay, name", [
    ("loopback", None, 0.0, "loopback"),
    ("100mbit", 100.0, 0.0, "100mbit"),
    ("1gbit", 1000.0, 0.0, "1gbit"),
    ("100mbit+1ms", 100.0, 1.0, "100mbit+1ms"),
    ("1Gbit+0.5ms", 1000.0, 0.5, "1gbit+0.5ms"),
])
def test_a_link_is_a_rate_and_an_optional_delay(text, rate, delay, name):
    link = Link.parse(text)
    assert (link.rate_mbit, link.delay_ms, link.name) == (rate, delay, name)
    assert Link.parse(link.name) == link


@pytest.mark.parametrize("text", ["100", "fast", "100mbit+1", "100mbit+-1ms", "100mbit+xms", "+1ms"])
def test_a_bad_link_names_itself(text):
    with pytest.raises(ValueError, match=re.escape(f"link '{text}'")):
        Link.parse(text)
