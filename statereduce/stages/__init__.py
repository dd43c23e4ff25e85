"""One module per workflow stage, named after its rule file (``rules/<stage>.smk``): ``pretrain``, ``capture``,
``allocate``, ``select``, ``prune``, ``rft`` and ``rank``. A stage reads its rule's artifacts, calls the layers below
it and writes its outputs atomically; no stage imports another."""
