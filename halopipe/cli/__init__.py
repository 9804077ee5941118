"""The ``halopipe`` command line: ``demo``, ``run``, ``verify`` and ``schema``.

* :mod:`~halopipe.cli.main`: the parser, ``--version``, ``--debug`` and the
  one-line failure messages (standard library only, so ``--help`` is instant);
* :mod:`~halopipe.cli.run`: ``run`` and ``verify`` (spawning ranks, restarts,
  summaries);
* :mod:`~halopipe.cli.demo`: ``demo`` and ``demo --evaluate``;
* :mod:`~halopipe.cli.rundir`: run directories and their locks;
* :mod:`~halopipe.cli.report`: setup notes and failure messages.

The library never imports this package; this package imports the library.
"""

from .main import main

__all__ = ["main"]
