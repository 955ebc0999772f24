"""A layer-sharded DSA indexer backup into a page_first host pool -- the call sglang refuses with
"Layer-sharded DSA indexer HiCache backup with page_first layout is not supported without a
per-layer LF->PF kernel." -- done through hicache_io.kvcacheio on numpy arrays.

The two classes are stand-ins for sglang's device and host indexer pools (numpy arrays in place
of torch tensors, the same shapes and the same token->page conversion). Run:

    python examples/python/sharded_backup.py
"""

import numpy as np

from hicache_io import kvcacheio

BYTES_PER_TOKEN = 132  # DeepSeek V3.2: 128 fp8 index values + one fp32 scale per 128
PAGE_SIZE = 64


class DeviceIndexerPool:
    """This rank's shard of the device indexer pool: owned layers only, one buffer each,
    ``[pages][page_size * bytes_per_token]``."""

    def __init__(self, layer_num, owned, pages, rng):
        self.layer_num = layer_num
        self.owned = owned  # (start, end): the layers this rank holds
        self.page_stride = PAGE_SIZE * BYTES_PER_TOKEN
        self.index_k_with_scale_buffer = {
            layer: rng.integers(0, 256, (pages, self.page_stride), dtype=np.uint8) for layer in range(*owned)
        }


class HostIndexerPool:
    """The host pool in page_first: ``[indexer_page_num][L][1][page_stride]``, ``L`` the owned
    layers (sglang's effective host layer count)."""

    def __init__(self, device_pool, size):
        start, end = device_pool.owned
        self.device_pool = device_pool
        self.layers = end - start
        self.page_stride = device_pool.page_stride
        self.page_num = (size + PAGE_SIZE + 1) // PAGE_SIZE
        self.buffer = np.zeros((self.page_num, self.layers, 1, self.page_stride), dtype=np.uint8)

    @staticmethod
    def pages(tokens):
        """sglang's token->page conversion: the first token of each page, divided by P."""
        if len(tokens) % PAGE_SIZE:
            raise ValueError("Index buffer transfer expects page-aligned indices for DSA.")
        return tokens[::PAGE_SIZE] // PAGE_SIZE

    def backup_from_device_all_layer(self, host_indices, device_indices):
        """The sharded backup sglang lacks: one per-layer LF->PF copy per owned layer."""
        host_pages, device_pages = self.pages(host_indices), self.pages(device_indices)
        start, _ = self.device_pool.owned
        for layer, src in self.device_pool.index_k_with_scale_buffer.items():
            kvcacheio.transfer_kv_per_layer_mla_lf_pf(
                src=src,
                dst=self.buffer,
                src_indices=device_pages,
                dst_indices=host_pages,
                layer_id=layer - start,
                item_size=self.page_stride,
                dst_layout_dim=self.page_stride * self.layers,
            )


def main():
    rng = np.random.default_rng(0)
    device = DeviceIndexerPool(layer_num=61, owned=(16, 32), pages=128, rng=rng)
    host = HostIndexerPool(device, size=512 * PAGE_SIZE)
    # Three device pages (scattered) backed up into three host pages.
    device_tokens = np.concatenate([np.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in (7, 40, 41)]).astype(np.int64)
    host_tokens = np.concatenate([np.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in (100, 3, 250)]).astype(np.int64)
    host.backup_from_device_all_layer(host_tokens, device_tokens)

    # Check every byte against numpy fancy indexing.
    want = np.zeros_like(host.buffer)
    for layer, src in device.index_k_with_scale_buffer.items():
        want[[100, 3, 250], layer - device.owned[0], 0] = src[[7, 40, 41]]
    assert np.array_equal(host.buffer, want), "host pool differs from the reference"
    moved = 3 * len(device.index_k_with_scale_buffer) * host.page_stride
    print(f"layer-sharded page_first DSA indexer backup: {len(device.index_k_with_scale_buffer)} layers, "
          f"{moved} bytes, matches numpy")


if __name__ == "__main__":
    main()
