"""Every benchmark of the project, as one package: ``python -m scripts.benchmarks`` (what
``scripts/bench`` runs) measures the figures its modules declare (``registry``), and several modules
also run alone (``python -m scripts.benchmarks.weight``, ``.ab``, ``.fresh``, ...: see
docs/development.md). Run from the project root; nothing here edits ``sys.path``."""
