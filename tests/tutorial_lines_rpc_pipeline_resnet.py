"""The code lines of "Distributed Pipeline Parallelism Using RPC", as data.

As of 2026-11-24 (PyTorch has since removed the tutorial; the code blocks are those of its
last version; imports left out, a call spread over several lines written as one). Each names the text of
rpc_pipeline_resnet/README.md's step map or "What differs" section that accounts for it
(tests/test_tutorial_maps.py checks that the text is there).

RPC_PIPELINE_RESNET_NAMES: what the tutorial defines and calls that a learner looks for, as
the tutorial wrote it; each must be in the example's code in that shape, or its README's
"What differs" section must name it (tests/test_tutorial_maps.py says what counts).
"""
from __future__ import annotations

_BASE = "Step 1: `ResNetBase`, its `_lock`"
_HONOURED = "**`num_classes` and `norm_layer` are honoured**"
_MAKE = "Step 1: `ResNetBase._make_layer`"
_SHARD1 = "Step 1: `ResNetShard1.__init__` (conv1 .. layer2, init)"
_FWD1 = "Step 1: `ResNetShard1.forward`: `to_here()`, lock, `self.seq`, `.cpu()`"
_SHARD2 = "Step 1: `ResNetShard2.__init__` (layer3 .. fc)"
_FWD2 = "Step 1: `ResNetShard2.forward`"
_DIST = "Step 2: `DistResNet50.__init__`"
_LOOP = "Step 2: `DistResNet50.forward`: the micro-batch loop"
_PARAMS = "Step 2: `DistResNet50.parameter_rrefs`"
_SIZES = "Step 3: `num_batches`, `batch_size`, `image_w`, `image_h` (flags)"
_DATA = "Step 3: random `inputs` and one-hot `labels`"
_NO_PORT = "No hard-coded `cuda:0`/`cuda:1` or port"
_MASTER = 'Step 4: rank 0: `rpc.init_rpc("master", ...)`'
_WORKER = 'Step 4: other ranks: `rpc.init_rpc(f"worker{rank}", ...)`'
_SPAWN = "Step 4: `mp.spawn(run_worker, ...)`"
_TIMING = "**Timing measures the pipeline only**"
_BATCH = "**Batches of 16 images by default** (`--batch_size`), not the tutorial's `batch_size = 120`"
_CONSTANT = "**`NUM_CLASSES = 1000`** is the tutorial's `num_classes = 1000`"
_ONCE = "by `ResNetBase`: the tutorial's shard 2 read the module's `num_classes`"
_IMAGE_SIZE = "**One `--image_size`** (128) for the tutorial's `image_w` and `image_h`"
_LOGGED = "**Logged, not printed**: the tutorial's two `print` lines are `log.info` calls"

RPC_PIPELINE_RESNET_TUTORIAL = [
    ("num_classes = 1000", _CONSTANT),
    ("def conv1x1(in_planes, out_planes, stride=1):", "Step 1: `conv1x1`"),
    ("return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)", "Step 1: `conv1x1`"),
    ("class ResNetBase(nn.Module):", _BASE),
    ("def __init__(self, block, inplanes, num_classes=1000, groups=1, width_per_group=64, norm_layer=None):",
     _HONOURED),
    ("super(ResNetBase, self).__init__()", _BASE),
    ("self._lock = threading.Lock()", _BASE),
    ("self._block = block", _BASE),
    ("self._norm_layer = nn.BatchNorm2d", _HONOURED),
    ("self.inplanes = inplanes", _BASE),
    ("self.dilation = 1", _BASE),
    ("self.groups = groups", _BASE),
    ("self.base_width = width_per_group", _BASE),
    ("def _make_layer(self, planes, blocks, stride=1):", _MAKE),
    ("norm_layer = self._norm_layer", _MAKE),
    ("downsample = None", _MAKE),
    ("previous_dilation = self.dilation", _MAKE),
    ("if stride != 1 or self.inplanes != planes * self._block.expansion:", _MAKE),
    ("downsample = nn.Sequential(conv1x1(self.inplanes, planes * self._block.expansion, stride), "
     "norm_layer(planes * self._block.expansion))", _MAKE),
    ("layers = []", _MAKE),
    ("layers.append(self._block(self.inplanes, planes, stride, downsample, self.groups, self.base_width, "
     "previous_dilation, norm_layer))", _MAKE),
    ("self.inplanes = planes * self._block.expansion", _MAKE),
    ("for _ in range(1, blocks):", _MAKE),
    ("layers.append(self._block(self.inplanes, planes, groups=self.groups, base_width=self.base_width, "
     "dilation=self.dilation, norm_layer=norm_layer))", _MAKE),
    ("return nn.Sequential(*layers)", _MAKE),
    ("def parameter_rrefs(self):", "Step 1: `ResNetBase.parameter_rrefs`"),
    ("return [RRef(p) for p in self.parameters()]", "Step 1: `ResNetBase.parameter_rrefs`"),
    ("class ResNetShard1(ResNetBase):", _SHARD1),
    ("def __init__(self, device, *args, **kwargs):", _SHARD1),
    ("super(ResNetShard1, self).__init__(Bottleneck, 64, num_classes=num_classes, *args, **kwargs)", _ONCE),
    ("self.device = device", _SHARD1),
    ("self.seq = nn.Sequential(nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False), "
     "self._norm_layer(self.inplanes), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=3, stride=2, padding=1), "
     "self._make_layer(64, 3), self._make_layer(128, 4, stride=2)).to(self.device)", _SHARD1),
    ("for m in self.modules():", _SHARD1),
    ("if isinstance(m, nn.Conv2d):", _SHARD1),
    ("nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')", _SHARD1),
    ("elif isinstance(m, nn.BatchNorm2d):", _SHARD1),
    ("nn.init.constant_(m.weight, 1)", _SHARD1),
    ("nn.init.constant_(m.bias, 0)", _SHARD1),
    ("def forward(self, x_rref):", _FWD1),
    ("x = x_rref.to_here().to(self.device)", _FWD1),
    ("with self._lock:", _FWD1),
    ("out = self.seq(x)", _FWD1),
    ("return out.cpu()", _FWD1),
    ("class ResNetShard2(ResNetBase):", _SHARD2),
    ("super(ResNetShard2, self).__init__(Bottleneck, 512, num_classes=num_classes, *args, **kwargs)", _ONCE),
    ("self.seq = nn.Sequential(self._make_layer(256, 6, stride=2), self._make_layer(512, 3, stride=2), "
     "nn.AdaptiveAvgPool2d((1, 1))).to(self.device)", _SHARD2),
    ("self.fc = nn.Linear(512 * self._block.expansion, num_classes).to(self.device)",
     _ONCE),
    ("out = self.fc(torch.flatten(self.seq(x), 1))", _FWD2),
    ("class DistResNet50(nn.Module):", _DIST),
    ("def __init__(self, num_split, workers, *args, **kwargs):", _DIST),
    ("super(DistResNet50, self).__init__()", _DIST),
    ("self.num_split = num_split", _DIST),
    ('self.p1_rref = rpc.remote(workers[0], ResNetShard1, args = ("cuda:0",) + args, kwargs = kwargs)',
     "Step 2: shard 1 on `workers[0]`: `rpc.remote(...)`"),
    ('self.p2_rref = rpc.remote(workers[1], ResNetShard2, args = ("cuda:1",) + args, kwargs = kwargs)',
     "Step 2: shard 2 on `workers[1]`"),
    ("def forward(self, xs):", _LOOP),
    ("out_futures = []", _LOOP),
    ("for x in iter(xs.split(self.split_size, dim=0)):", "**`num_split` is the number of micro-batches.**"),
    ("x_rref = RRef(x)", "Step 2: `x_rref = RRef(x)`"),
    ("y_rref = self.p1_rref.remote().forward(x_rref)", "Step 2: `y_rref = self.p1_rref.remote().forward(x_rref)`"),
    ("z_fut = self.p2_rref.rpc_async().forward(y_rref)", "Step 2: `z_fut = self.p2_rref.rpc_async().forward(y_rref)`"),
    ("out_futures.append(z_fut)", _LOOP),
    ("return torch.cat(torch.futures.wait_all(out_futures))", "Step 2: `torch.cat(torch.futures.wait_all(out_futures))`"),
    ("def parameter_rrefs(self):", _PARAMS),
    ("remote_params = []", _PARAMS),
    ("remote_params.extend(self.p1_rref.remote().parameter_rrefs().to_here())", _PARAMS),
    ("remote_params.extend(self.p2_rref.remote().parameter_rrefs().to_here())", _PARAMS),
    ("return remote_params", _PARAMS),
    ("num_batches = 3", _SIZES),
    ("batch_size = 120", _BATCH),
    ("image_w = 128", _IMAGE_SIZE),
    ("image_h = 128", _IMAGE_SIZE),
    ("def run_master(num_split):", "Step 3: `run_master(num_split)`"),
    ('model = DistResNet50(num_split, ["worker1", "worker2"])', 'Step 3: `model = DistResNet50(num_split, ["worker1", "worker2"])`'),
    ("loss_fn = nn.MSELoss()", "Step 3: `loss_fn = nn.MSELoss()`"),
    ("opt = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)",
     "Step 3: `DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=0.05)`"),
    ("one_hot_indices = torch.LongTensor(batch_size).random_(0, num_classes).view(batch_size, 1)",
     "Step 3: `one_hot_indices`"),
    ("for i in range(num_batches):", "Step 3: `for i in range(num_batches)`"),
    ('print(f"Processing batch {i}")', _LOGGED),
    ("inputs = torch.randn(batch_size, 3, image_w, image_h)", _DATA),
    ("labels = torch.zeros(batch_size, num_classes).scatter_(1, one_hot_indices, 1)", _DATA),
    ("with dist_autograd.context() as context_id:", "Step 3: `with dist_autograd.context() as context_id`"),
    ("outputs = model(inputs)", "Step 3: `outputs = model(inputs)`"),
    ("dist_autograd.backward(context_id, [loss_fn(outputs, labels)])", "**The loss gets its own line**"),
    ("opt.step(context_id)", "Step 3: `opt.step(context_id)`"),
    ("def run_worker(rank, world_size, num_split):",
     "**`run_worker(rank, args)`**, not `run_worker(rank, world_size, num_split)`"),
    ("os.environ['MASTER_ADDR'] = 'localhost'", _NO_PORT),
    ("os.environ['MASTER_PORT'] = '29500'", _NO_PORT),
    ("options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=128)",
     "**`rpc_timeout` in the backend options**"),
    ("if rank == 0:", _MASTER),
    ('rpc.init_rpc("master", rank=rank, world_size=world_size, rpc_backend_options=options)', _MASTER),
    ("run_master(num_split)", "Step 4: rank 0: `run_master(num_split)`"),
    ('rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)', _WORKER),
    ("pass", _WORKER),
    ("rpc.shutdown()", "Step 4: `rpc.shutdown()`"),
    ('if __name__=="__main__":', _SPAWN),
    ("world_size = 3", "Step 4: `world_size = 3`"),
    ("for num_split in [1, 2, 4, 8]:", "Step 4: `__main__`: `for num_split in [1, 2, 4, 8]`"),
    ("tik = time.time()", _TIMING),
    ("mp.spawn(run_worker, args=(world_size, num_split), nprocs=world_size, join=True)", _SPAWN),
    ("tok = time.time()", _TIMING),
    ('print(f"number of splits = {num_split}, execution time = {tok - tik}")', _LOGGED),
]

RPC_PIPELINE_RESNET_NAMES = [
    "num_classes = 1000",
    "def conv1x1(in_planes, out_planes, stride=1)",
    "class ResNetBase(nn.Module)",
    "def ResNetBase.__init__(self, block, inplanes, num_classes=1000, groups=1, width_per_group=64, "
    "norm_layer=None)",
    "def ResNetBase._make_layer(self, planes, blocks, stride=1)",
    "def ResNetBase.parameter_rrefs(self)",
    "class ResNetShard1(ResNetBase)",
    "def ResNetShard1.__init__(self, device, *args, **kwargs)",
    "def ResNetShard1.forward(self, x_rref)",
    "class ResNetShard2(ResNetBase)",
    "def ResNetShard2.__init__(self, device, *args, **kwargs)",
    "def ResNetShard2.forward(self, x_rref)",
    "class DistResNet50(nn.Module)",
    "def DistResNet50.__init__(self, num_split, workers, *args, **kwargs)",
    "def DistResNet50.forward(self, xs)",
    ("self.split_size", "self.split_size"),
    "def DistResNet50.parameter_rrefs(self)",
    "num_batches = 3",
    "batch_size = 120",
    "image_w = 128",
    "image_h = 128",
    "def run_master(num_split)",
    ('print(f"Processing batch {i}")', "print"),
    "def run_worker(rank, world_size, num_split)",
    ("rpc.TensorPipeRpcBackendOptions(num_worker_threads=128)", "rpc_timeout"),
    "world_size = 3",
]
