"""The benchmark harness: the end-to-end sweep (``sweep``), its results document (``results``,
``results.schema.json``), figures (``plots``) and the reproduction report (``report``)."""
