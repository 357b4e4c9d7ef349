"""Stragglers: the rank (or node) the others wait for, once per episode.

- ``_pace``: step times from the progress board, their window and the step-time judge;
- ``_watch``: one attempt's detection on one node, exchanged through the run store;
- ``_exchange``: what the judge does with every node's records there (present, fresh);
- ``_arrivals``: in lock-step training, the judge by arrival at the collectives;
- ``_arrival_watch``: asking the workers for their arrivals and judging them, across nodes
  with ``_arrival_records`` (a node's sample in the store) and ``_clock_offset`` (each
  node's clock offset, measured through the store).
"""
