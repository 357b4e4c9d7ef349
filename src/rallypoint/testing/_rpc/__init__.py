"""The RPC contract suites of ``rallypoint.testing`` and the programs they run.

- ``_contract``: the checks every RPC backend must pass (``run_rpc_contract``), and the
  usage patterns of ``_patterns`` run through both backends;
- ``_autograd_contract``: distributed autograd and ``DistributedOptimizer`` checks
  (``run_rpc_autograd_contract``);
- ``_program_ddp`` / ``_program_rnn``: whole torch example programs written against
  ``rallypoint.rpc``; ``_torch_program`` writes one out as torch's (only imports change).
"""
