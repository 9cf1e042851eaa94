"""KVTC's per-model PCA basis: the parameters it is fitted for and where a model's is named.

The basis itself is a :class:`~cachegen.codec.transform.basis.TransformBasis`; it is fitted in the
core (``cachegen.fitting.kvtc.ensure_kvtc_basis``), which tcq's fitting reuses, while the
``kvtc`` codec that codes with it is a research codec (``cachegen_lab.codecs.kvtc``).
"""

from __future__ import annotations

from cachegen.codec.transform.basis import BASES
from cachegen.codec.transform.model_file import ModelFileRef

# the first tokens of a sequence (the attention sinks), stored exactly and left out of the fit
EXACT_TOKENS = 4
# level -> budget in bits per element before DEFLATE
LEVELS = {10: 1.0, 15: 1.5, 20: 2.0, 30: 3.0, 40: 4.0}
REF_SCHEMA = "cachegen-kvtc-basis-ref"
REF_VERSION = 1

KVTC_REF = ModelFileRef(
    "kvtc basis",
    "kvtc",
    (REF_SCHEMA, REF_VERSION),
    "basis",
    "cachegen.fitting.kvtc.ensure_kvtc_basis",
    BASES,
)
basis_ref_path, read_kvtc_basis_ref = KVTC_REF.path, KVTC_REF.read
write_kvtc_basis_ref, load_kvtc_basis = KVTC_REF.write, KVTC_REF.load
