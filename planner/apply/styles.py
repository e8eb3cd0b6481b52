"""ParallelStyles torch does not provide, for the modules `planner.apply.tensor_parallel` splits:
MoE experts' stacked weights (`GroupedLinearParallel`) and the key/value projections of attention
with fewer key/value heads than tp ranks (`SharedKeyValueParallel`). Inputs and outputs are local
tensors, as the layout translation's convention has them.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class GroupedLinearParallel(ParallelStyle):
    """Tensor parallelism of a `GroupedLinear` (weight: experts x in_features x out_features), as
    Colwise/RowwiseParallel split a Linear: colwise shards out_features (weight dim 2), reads the
    replicated input and returns its feature slice; rowwise shards in_features (weight dim 1), reads
    a feature slice and returns the all-reduced output. Inputs and outputs are local tensors."""

    def __init__(self, colwise: bool):
        super().__init__()
        self.colwise = colwise

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight_dim = 2 if self.colwise else 1

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(
                    distribute_tensor(param, mesh, [Shard(weight_dim)], src_data_rank=self.src_data_rank)))

        def prepare_input(mod: nn.Module, inputs, mesh: DeviceMesh):
            placement = Replicate() if self.colwise else Shard(2)
            return (DTensor.from_local(inputs[0], mesh, [placement], run_check=False), *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh):
            return (output if self.colwise else output.redistribute(mesh, [Replicate()])).to_local()

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)


class SharedKeyValueParallel(ParallelStyle):
    """Key or value projection of attention with fewer key/value heads than tp ranks (tp a multiple
    of them: multi-query attention's one head, or grouped-query heads each shared by tp / kv_heads
    ranks) whose core runs on local query heads. The projection's output is replicated (computed
    colwise and all-gathered, or computed whole from replicated weights) and each rank keeps the
    head its query heads share. Ranks' query heads give a head different gradients: the output's
    gradient is a partial sum (reduce-scattered back to the colwise shards, or summed into the
    replicated weight's gradient by FSDP2), as Megatron-LM forks with multi-query attention reduce
    it. Input: the container's replicated input; output: a local tensor of one head."""

    def __init__(self, colwise: bool, head_dim: int, ranks_per_head: int):
        super().__init__()
        self.colwise = colwise
        self.head_dim = head_dim
        self.ranks_per_head = ranks_per_head

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placement = Shard(0) if self.colwise else Replicate()

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(param_name, nn.Parameter(
                    distribute_tensor(param, mesh, [placement], src_data_rank=self.src_data_rank)))

        def prepare_input(mod: nn.Module, inputs, mesh: DeviceMesh):
            x = inputs[0]
            x = x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor) else DTensor.from_local(
                x, mesh, [Replicate()], run_check=False)
            return (x, *inputs[1:])

        def prepare_output(mod: nn.Module, output: DTensor, mesh: DeviceMesh):
            heads = output.redistribute(mesh, [Replicate()]).to_local(grad_placements=(Partial(),))
            head = mesh.get_local_rank() // self.ranks_per_head
            return heads[..., head * self.head_dim:(head + 1) * self.head_dim]

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)
