"""Testing helpers every backend package uses: inputs, the fp64 comparison, the conformance suite.

Shipped with mlacore as `numpy.testing` ships with numpy, so a backend
package's tests check it against exactly the semantics the core defines:

* `make_inputs` builds fresh random inputs with NaN-poisoned unused pages
  and page tails and shuffled page ids;
* `reference_outputs` and `compare` run the fp64 oracle and compare with
  tolerances per dtype (every output element must be written);
* `mlacore.testing.conformance.BackendConformance` is the suite (it imports
  pytest, so it is not imported here).
"""

from .compare import (
    CheckResult,
    check_backend,
    compare,
    only_backend_dispatcher,
    reference_outputs,
    rel_err,
)
from .inputs import FP8_MAX, DecodeInputs, make_inputs

__all__ = [
    "CheckResult", "DecodeInputs", "FP8_MAX", "check_backend", "compare", "make_inputs",
    "only_backend_dispatcher", "reference_outputs", "rel_err",
]
