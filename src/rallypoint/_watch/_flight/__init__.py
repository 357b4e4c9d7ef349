"""torch's Flight Recorder in every worker, and what the agents make of it.

- ``_records``: one worker's recorded collectives as records that travel (``RankTrace``);
- ``_recorder``: recording on by default, the worker's dumper thread and the agent's
  request for its dump (``FlightRequest``);
- ``_final``: the trace a worker leaves when a collective times out (and NCCL's dump);
- ``_analysis``: the root rank and collective of a hang, mismatches, waits across groups;
- ``_format``: the root-cause block and the collective view on the screen.
"""
