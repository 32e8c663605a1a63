"""The code lines of "Combining Distributed DataParallel with Distributed RPC Framework", as data.

The tutorial shows its code by ``literalinclude`` of pytorch/tutorials'
``advanced_source/rpc_ddp_tutorial/main.py``; these are that file's lines (as of 2026-11-24;
imports, comments and docstrings left out, a call spread over several lines written as one).
Each names the text of ddp_rpc/README.md's step map or "What differs" section that accounts
for it (tests/test_tutorial_maps.py checks that the text is there).

DDP_RPC_NAMES: what the tutorial defines and calls that a learner looks for, as the tutorial
wrote it; each must be in the example's code in that shape, or ddp_rpc/README.md's "What
differs" section must name it (tests/test_tutorial_maps.py says what counts).
"""
from __future__ import annotations

DDP_RPC_TUTORIAL = [
    ("NUM_EMBEDDINGS = 100", "`NUM_EMBEDDINGS = 100`"),
    ("EMBEDDING_DIM = 16", "`EMBEDDING_DIM = 16`"),
    ("class HybridModel(torch.nn.Module):", "`class HybridModel(torch.nn.Module)`"),
    ("def __init__(self, remote_emb_module, device):", "`HybridModel.__init__(self, remote_emb_module, device)`"),
    ("super(HybridModel, self).__init__()", "`HybridModel.__init__(self, remote_emb_module, device)`"),
    ("self.remote_emb_module = remote_emb_module", "`self.remote_emb_module = remote_emb_module`"),
    ("self.fc = DDP(torch.nn.Linear(16, 8).cuda(device), device_ids=[device])",
     "Here `.cuda(device)` is `.to(device)`, `device_ids` is given only on CUDA"),
    ("self.device = device", "`HybridModel.__init__(self, remote_emb_module, device)`"),
    ("def forward(self, indices, offsets):", "`HybridModel.forward(self, indices, offsets)`"),
    ("emb_lookup = self.remote_emb_module.forward(indices, offsets)", "forward: embedding lookup on the parameter server"),
    ("return self.fc(emb_lookup.cuda(self.device))", "forward: the lookup through the DDP-wrapped `fc`"),
    ("def _run_trainer(remote_emb_module, rank):", "`_run_trainer(remote_emb_module, rank)`"),
    ("model = HybridModel(remote_emb_module, rank)", "**The trainer's device is its process group's**"),
    ("model_parameter_rrefs = model.remote_emb_module.remote_parameters()",
     "`model.remote_emb_module.remote_parameters()`"),
    ("for param in model.fc.parameters():", "an `RRef` for each of `model.fc.parameters()`"),
    ("model_parameter_rrefs.append(RRef(param))", "`model_parameter_rrefs.append(RRef(param))`"),
    ("opt = DistributedOptimizer(optim.SGD, model_parameter_rrefs, lr=0.05)",
     "**`DistributedOptimizer(SerializedSGD, ...)`, not `optim.SGD`.**"),
    ("criterion = torch.nn.CrossEntropyLoss()", "`criterion = torch.nn.CrossEntropyLoss()`"),
    ("def get_next_batch(rank):", "`get_next_batch(rank)`: random indices, offsets, targets"),
    ("for _ in range(10):", "`--batches_per_epoch` (10, as in the tutorial)"),
    ("num_indices = random.randint(20, 50)", "**Seeded batches that can be learnt.**"),
    ("indices = torch.LongTensor(num_indices).random_(0, NUM_EMBEDDINGS)", "**Seeded batches that can be learnt.**"),
    ("offsets = []", "**Seeded batches that can be learnt.**"),
    ("start = 0", "**Seeded batches that can be learnt.**"),
    ("batch_size = 0", "**Seeded batches that can be learnt.**"),
    ("while start < num_indices:", "**Seeded batches that can be learnt.**"),
    ("offsets.append(start)", "**Seeded batches that can be learnt.**"),
    ("start += random.randint(1, 10)", "**Seeded batches that can be learnt.**"),
    ("batch_size += 1", "**Seeded batches that can be learnt.**"),
    ("offsets_tensor = torch.LongTensor(offsets)", "**Seeded batches that can be learnt.**"),
    ("target = torch.LongTensor(batch_size).random_(8).cuda(rank)", "**Seeded batches that can be learnt.**"),
    ("yield indices, offsets_tensor, target", "**Seeded batches that can be learnt.**"),
    ("for epoch in range(100):", "`--epochs` (10, not 100)"),
    ("for indices, offsets, target in get_next_batch(rank):", "`for indices, offsets, target in get_next_batch(rank)`"),
    ("with dist_autograd.context() as context_id:", "1) create a distributed autograd context"),
    ("output = model(indices, offsets)", "2) forward pass"),
    ("loss = criterion(output, target)", "3) the loss"),
    ("dist_autograd.backward(context_id, [loss])", "4) distributed backward pass"),
    ("opt.step(context_id)", "5) distributed optimizer step"),
    ('print("Training done for epoch {}".format(epoch))', '`print("Training done for epoch {}")`'),
    ("def run_worker(rank, world_size):", "**`run_worker(rank, args)`**, not `run_worker(rank, world_size)`"),
    ("rpc_backend_options = TensorPipeRpcBackendOptions()", "`TensorPipeRpcBackendOptions`"),
    ('rpc_backend_options.init_method = "tcp://localhost:29501"', "**No hard-coded ports.**"),
    ("if rank == 2:", "**The master's part is a function, `run_master(args)`**"),
    ('rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)',
     'rank 2 is the master: `rpc.init_rpc("master", ...)`'),
    ('remote_emb_module = RemoteModule("ps", torch.nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM), '
     'kwargs={"mode": "sum"})', 'the master creates the `RemoteModule` on `"ps"`'),
    ("futs = []", "kick off `_run_trainer` on each trainer with `rpc_async`"),
    ("for trainer_rank in [0, 1]:", "ranks `0..N-3` train"),
    ('trainer_name = "trainer{}".format(trainer_rank)', "kick off `_run_trainer` on each trainer with `rpc_async`"),
    ("fut = rpc.rpc_async(trainer_name, _run_trainer, args=(remote_emb_module, trainer_rank))",
     "`rpc.rpc_async(trainer_name, _run_trainer`"),
    ("futs.append(fut)", "kick off `_run_trainer` on each trainer with `rpc_async`"),
    ("for fut in futs:", "wait for all training to finish"),
    ("fut.wait()", "`wait_for_trainers` replaces the tutorial's `fut.wait()` loop"),
    ("elif rank <= 1:", "ranks `0..N-3` train"),
    ('dist.init_process_group(backend="gloo", rank=rank, world_size=2, init_method="tcp://localhost:29500")',
     "trainers: `dist.init_process_group(...)` for DDP, world size 2"),
    ('trainer_name = "trainer{}".format(rank)', "trainers: `rpc.init_rpc(trainer_name, ...)`"),
    ("rpc.init_rpc(trainer_name, rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)",
     "trainers: `rpc.init_rpc(trainer_name, ...)`"),
    ('rpc.init_rpc("ps", rank=rank, world_size=world_size, rpc_backend_options=rpc_backend_options)',
     'rank 3, the parameter server: `rpc.init_rpc("ps", ...)`'),
    ("pass", 'rank 3, the parameter server: `rpc.init_rpc("ps", ...)`'),
    ("rpc.shutdown()", "block until all rpcs finish"),
    ('if __name__ == "__main__":', "`mp.spawn(run_worker, ...)`"),
    ("world_size = 4", "`world_size = 4`"),
    ("mp.spawn(run_worker, args=(world_size,), nprocs=world_size, join=True)", "`mp.spawn(run_worker, ...)`"),
]

DDP_RPC_NAMES = [
    "NUM_EMBEDDINGS = 100",
    "EMBEDDING_DIM = 16",
    "class HybridModel(torch.nn.Module)",
    "def HybridModel.__init__(self, remote_emb_module, device)",
    "def HybridModel.forward(self, indices, offsets)",
    "def _run_trainer(remote_emb_module, rank)",
    ("HybridModel(remote_emb_module, rank)", "bound_device_id"),
    "def get_next_batch(rank)",
    "def run_worker(rank, world_size)",
    "world_size = 4",
]
