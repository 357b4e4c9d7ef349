"""Remote references: :mod:`._rref` (the ``RRef`` users hold, forks and confirmations) and
:mod:`._table` (the values a worker owns and the references in flight)."""
