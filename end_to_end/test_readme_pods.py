"""The README's pod parts, run as written (end_to_end/readme.py says how): train_compile.py and plan.py for TPU
topologies with the libtpu setup.sh installs; the cluster commands are skipped with their reasons."""

from __future__ import annotations

import pytest
import readme

pytestmark = pytest.mark.slow  # see pytest.ini: the quick tier leaves these out

PART = "pods"

ran = readme.ran_fixture(PART)
test_readme_step = readme.step_test(PART)
