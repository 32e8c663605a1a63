"""Pipeline parallelism with torch.distributed.pipelining on a GPT-style transformer."""
