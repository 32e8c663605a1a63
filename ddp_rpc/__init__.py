"""Combining DistributedDataParallel with the Distributed RPC framework (embedding on a
parameter server, a DDP-replicated ``nn.Linear`` on the trainers)."""
