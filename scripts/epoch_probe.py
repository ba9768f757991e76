"""Epoch-boundary stall probe (#15): time the train loader's epochs in a process that has
(a) nothing else, (b) CUDA + TransformerEngine + a torch.compile'd function."""
import sys
import time


def epochs(tag, loader, n=3):
    for epoch in range(n):
        t = time.time()
        first = None
        count = 0
        for _ in loader:
            if first is None:
                first = time.time() - t
            count += 1
        print(f"{tag} epoch {epoch}: {count} batches, first batch {first:.2f} s, "
              f"whole epoch {time.time() - t:.2f} s", flush=True)


def main():
    from fp8_lightning.data.streaming import TokenShardDataModule

    import tempfile

    # A fresh cache: prepare runs in this process first, as in the first fit on a new machine.
    dm = TokenShardDataModule(seq_len=1024, batch_size=8, num_workers=4,
                              cache_dir=tempfile.mkdtemp())
    dm.prepare_data()
    dm.setup("fit")
    import multiprocessing

    epochs(f"after prepare (start method {multiprocessing.get_start_method()})",
           dm.train_dataloader())
    import torch
    import transformer_engine.pytorch  # noqa: F401

    torch.zeros(1, device="cuda")
    f = torch.compile(lambda x: (x * 2).sum())
    f(torch.randn(64, device="cuda"))
    epochs("cuda+te+compile", dm.train_dataloader())


if __name__ == "__main__":
    main()
