"""Quality with decoded KV: what a codec's bits cost in the model's answers.

Modules: ``replay`` (run a model with a given KV as the past), ``window``/``datasets``/
``retrieval`` (offline evaluation data), ``metrics`` (perplexity, agreement, KL, ROUGE-L,
BLEU, retrieval accuracy), ``evaluate`` (one pass over windows for many candidates),
``candidates`` (codecs as candidates), ``frontier``/``report`` (Pareto frontier, tables,
plots), ``rd_sweep`` and ``calibrate`` (rate-distortion sweeps and calibrated levels).
"""
