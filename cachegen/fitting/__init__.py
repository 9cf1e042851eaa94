"""Fitting the transform codecs' model files from a model: the one place besides
``cachegen.profiles`` that runs a model to make what a codec reads.

* :mod:`cachegen.fitting.kvtc`: the model's KVTC basis (``cachegen.codec.transform.basis``), PCA
  fitted on the workload's ``calibrate`` split only, built on first use.
* :mod:`cachegen.fitting.tcq`: the model's ``tcq`` model (``cachegen.codec.tcq.model``): the
  KVTC basis, component weights from the model's queries and output projections
  (:mod:`cachegen.fitting.attention`), and each level's rANS tables from the ``calibrate``
  split's histograms; built on first use.

Fitting is deterministic as long as the model's forward pass is (same weights, same torch
CPU kernels).
"""
