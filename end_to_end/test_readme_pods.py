"""The README's pod parts (end_to_end/readme.py says how): each line is listed, and skipped with its reason: the
cluster commands need TPU VMs, a bucket or a GPU cluster, and the pod-scale compiles are measurements (readme.SKIPPED
names the tests that run train_compile.py and plan.py for v5p)."""

from __future__ import annotations

import pytest
import readme

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

PART = "pods"

ran = readme.ran_fixture(PART)
test_readme_step = readme.step_test(PART)
