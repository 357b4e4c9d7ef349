"""The RPC transport: authenticated connections that move frames of bytes and tensors.

:mod:`._connection` (one peer's socket: send, read, hand-over), :mod:`._framing` (frames
in a buffer), :mod:`._wire` and :mod:`._flat_wire` (a message's pickle and tensors),
:mod:`._shm` (same-host tensors in shared memory), :mod:`._cuda_routes` and :mod:`._cuda`
(CUDA tensors: by CUDA IPC on one host, else staged), :mod:`._acceptor` and :mod:`._auth`
(the listener and the HMAC handshake of :mod:`rallypoint._core`), :mod:`._reader_pool`
(threads that read) and :mod:`._spin` (how threads wait). It imports nothing from the
agent, groups, RRefs or distributed autograd.
"""
