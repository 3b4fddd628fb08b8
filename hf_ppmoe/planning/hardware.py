"""The hardware a plan is made for: GPU presets from NVIDIA's data sheets, and a cluster of them. Standard library
only (`hf-ppmoe plan --help` and its flag errors come before torch is imported).

Every number is the data sheet's, with its source beside it, and one efficiency factor per GPU kind: the share of
the dense tensor-core peak that a published large dense training run sustained end to end. The factor was fixed,
with its source, before any prediction was compared with a measurement (benchmarks/RESULTS.md, "Planning").

Conventions:
- `peak_flops`: dense (no 2:4 sparsity) 16-bit tensor-core FLOP/s, the number the model's FLOPs are divided by.
- `nvlink`: bytes/s one GPU sends to the others of its node in one direction. Data sheets give the total over both
  directions (V100 300 GB/s = 6 links x 25 GB/s each way x 2), so this is half the data sheet's number.
- `internode`: bytes/s a whole node sends in one direction over its network cards (8 x 400 Gb/s = 400 GB/s),
  shared by its GPUs when they all communicate at once (as the ranks of a layout do).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes
    peak_flops: float  # dense 16-bit tensor FLOP/s
    hbm: float  # memory bandwidth, bytes/s
    nvlink: float  # bytes/s each way, per GPU (half the data sheet's bidirectional total)
    efficiency: float  # share of peak_flops sustained by a published dense training run (see EFFICIENCY_SOURCES)
    source: str


# NVIDIA data sheets
_V100 = "NVIDIA Tesla V100 data sheet (volta-v100-datasheet-update-us-1165301-r5): V100 SXM2 32 GB HBM2 900 GB/s, " \
        "125 TFLOPS tensor (fp16), NVLink 300 GB/s"
_A100 = "NVIDIA A100 data sheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): A100 SXM 80 GB HBM2e 2,039 GB/s, " \
        "BF16 tensor 312 TFLOPS dense (624 with sparsity), NVLink 600 GB/s"
_H100 = "NVIDIA H100 Tensor Core GPU data sheet: H100 SXM 80 GB HBM3 3.35 TB/s, BF16 tensor 1,979 TFLOPS with " \
        "sparsity = 989 dense, NVLink 900 GB/s"
_H200 = "NVIDIA H200 Tensor Core GPU data sheet: H200 SXM 141 GB HBM3e 4.8 TB/s, BF16 tensor 1,979 TFLOPS with " \
        "sparsity = 989 dense (the H100's GH100 die), NVLink 900 GB/s"

EFFICIENCY_SOURCES = {
    "V100": "Shoeybi et al. 2019, Megatron-LM (arXiv 1909.08053), abstract: a single V100 sustains 39 TFLOPS, "
            "30% of peak, training an 8.3B GPT",
    "A100": "Narayanan et al. 2021, Megatron-LM on GPU clusters (arXiv 2104.04473), abstract: 502 PFLOP/s on 3,072 "
            "A100, 52% of peak per GPU",
    "H100": "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 38-43% BF16 MFU on 8K-16K "
            "H100 for the 405B model; 40% taken",
    "H200": "the H100's factor: the same GH100 die and clocks (only memory differs)",
}

GPUS = {
    "V100": GPU("V100", 32 * GB, 125e12, 900 * GB, 150 * GB, 0.30, _V100),
    "A100": GPU("A100", 80 * GB, 312e12, 2039 * GB, 300 * GB, 0.52, _A100),
    "H100": GPU("H100", 80 * GB, 989e12, 3350 * GB, 450 * GB, 0.40, _H100),
    "H200": GPU("H200", 141 * GB, 989e12, 4800 * GB, 450 * GB, 0.40, _H200),
}

# Inter-node networks: NICs per node x rate. DGX A100: 8 x 200 Gb/s HDR InfiniBand (ConnectX-6); DGX H100/H200:
# 8 x 400 Gb/s NDR InfiniBand (ConnectX-7; DGX H100 user guide, "Network Modules"). The PPMoE paper's V100 cluster:
# 100 Gb/s InfiniBand per node ("B = 12.5e9 for inter-node communication (InfiniBand ... in the Huawei Cloud cluster
# we experiment on)", Sec. 3.2; its nodes are 8 x V100 SXM2 with NVLink).
NETWORKS = {"V100": "1x100", "A100": "8x200", "H100": "8x400", "H200": "8x400"}


def parse_network(text: str) -> float:
    """"8x400" (NICs x Gb/s) or "400" (Gb/s) -> bytes/s each way for the whole node."""
    count, _, rate = text.lower().replace(" ", "").rpartition("x")
    try:
        value = (int(count) if count else 1) * float(rate)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"network {text!r}: give NICs x Gb/s per node, e.g. 8x400 (eight 400 Gb/s InfiniBand cards).")
    return value * 1e9 / 8


@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs of one kind, `gpus_per_node` to a node (NVLink inside a node, the network between nodes)."""

    gpu: GPU
    gpus: int
    gpus_per_node: int = 8
    internode: float | None = None  # bytes/s each way per node; None: the GPU kind's network in NETWORKS
    usable: float = 0.9  # share of the memory a plan may fill (allocator fragmentation, CUDA context, workspaces)

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus={self.gpus}, gpus_per_node={self.gpus_per_node}: both must be >= 1.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node} GPUs.")
        if self.internode is None:
            object.__setattr__(self, "internode", parse_network(NETWORKS.get(self.gpu.name, "8x400")))

    @classmethod
    def of(cls, gpu: str | GPU, gpus: int, gpus_per_node: int = 8, *, memory: float | None = None,
           network: str | None = None, efficiency: float | None = None) -> Cluster:
        """A cluster of a preset (`gpu` "V100", "A100", "H100", "H200") or a `GPU`; `memory` (bytes), `network`
        ("8x400") and `efficiency` override the preset's."""
        if isinstance(gpu, str):
            key = gpu.upper()
            if key not in GPUS:
                raise ValueError(f"unknown GPU {gpu!r}; presets: {', '.join(GPUS)} (or pass a hf_ppmoe.planning.GPU).")
            gpu = GPUS[key]
        changes = {k: v for k, v in (("memory", memory), ("efficiency", efficiency)) if v is not None}
        gpu = replace(gpu, **changes) if changes else gpu
        return cls(gpu, gpus, gpus_per_node, None if network is None else parse_network(network))

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)

    @property
    def nic_per_gpu(self) -> float:
        """Inter-node bytes/s each way one GPU gets when every GPU of its node communicates."""
        return self.internode / min(self.gpus, self.gpus_per_node)

    def describe(self) -> str:
        net = f", {self.internode * 8 / 1e9:,.0f} Gb/s per node between nodes" if self.nodes > 1 else ""
        return (f"{self.gpus} x {self.gpu.name} ({self.gpu.memory / GB:,.0f} GB, {self.gpu.peak_flops / 1e12:,.0f} "
                f"TFLOPS x efficiency {self.gpu.efficiency}, NVLink {self.gpu.nvlink / GB:,.0f} GB/s each way), "
                f"{self.gpus_per_node} per node{net}")


__all__ = ["EFFICIENCY_SOURCES", "GPU", "GPUS", "Cluster", "NETWORKS", "parse_network"]
