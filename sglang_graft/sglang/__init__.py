"""Graft as an SGLang speculative algorithm, installed as a plugin (no fork).

SGLang's plugin loader (entry-point group ``sglang.srt.plugins``) calls
``sglang_graft.sglang.plugin.register`` in the launcher and in every scheduler
subprocess. Registration checks the pinned SGLang version (``version``) and adds:

* the algorithms ``GRAFT`` (an EAGLE-3 draft head) and ``GRAFT_STANDALONE`` (a plain
  small LM as draft), through ``SpeculativeAlgorithm.register`` (``spec_algo``);
* ``--graft-*`` launch flags and the startup checks of a Graft launch (``settings``,
  ``server_args_hooks``).

The workers (``worker``) extend SGLang's EAGLE V2 / standalone V2 workers on the draft
side only. Everything they add that is not SGLang glue is plain PyTorch, tested on CPU:
the tree-building step (``tree_step``), a worker's state across rounds (``session``),
verify feedback and per-source reporting (``feedback``), request bookkeeping
(``request_sync``) and the radix-cache feed of the history index (``radix_feed``).
Which SGLang code compares the algorithm by name, and how each place is handled, is in
``AUDIT.md``. Importing this package imports nothing from SGLang.
"""
