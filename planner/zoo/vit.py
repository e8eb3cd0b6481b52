"""Vision Transformer: patch embedding, class token, pre-LN encoder, classification head."""
from __future__ import annotations

import torch
from torch import nn

from planner.zoo.layers import INIT_STD, Attention, Block, GeluMLP
from planner.zoo.spec import ModelSpec

# RGB input images.
IMAGE_CHANNELS = 3


class PatchEmbedding(nn.Module):
    """Conv patchify, prepend the class token, add learned positions.

    Args:
        spec: a spec with arch vit.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.proj = nn.Conv2d(IMAGE_CHANNELS, spec.hidden, spec.patch_size, stride=spec.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, spec.hidden))
        self.positions = nn.Parameter(torch.empty(1, spec.num_patches + 1, spec.hidden))
        nn.init.normal_(self.positions, std=INIT_STD)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.positions


class VisionTransformer(nn.Module):
    """ViT (Dosovitskiy et al. 2021) without dropout; top-level children embed, layers, norm,
    head, loss, in pipeline order.

    Args:
        spec: a spec with arch vit.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed = PatchEmbedding(spec)
        self.layers = nn.ModuleList(
            Block(Attention(spec.hidden, spec.heads, spec.kv_heads, bias=True, causal=False),
                  GeluMLP(spec.hidden, spec.ffn_hidden),
                  lambda: nn.LayerNorm(spec.hidden))
            for _ in range(spec.layers)
        )
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the cross entropy of the class-token logits against class 0 for every image.

        The fixed labels keep the forward a function of the images alone while giving a scalar
        loss, so backward is part of the traced step.

        Args:
            images: (batch, 3, image_size, image_size).

        Returns:
            A scalar loss.
        """
        x = self.embed(images)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)[:, 0])
        labels = torch.zeros(images.shape[0], dtype=torch.long, device=images.device)
        return self.loss(logits.float(), labels)
