"""The benchmark harness: the end-to-end sweep (``sweep``), its results document (``results``,
``results.schema.json``, whose rows are rows of ``rows.schema.json``), figures (``plots``), the
reproduction report (``reproduction``), the vLLM engines it drives (``engine``,
``engine_process``), TTFT tables (``ttft``), the streaming bench (``stream_bench``)
and the codec report (``codec_report``)."""
