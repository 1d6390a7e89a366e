import torch, patchgemm
torch.manual_seed(0)
for shape, k, E, fmt in [((8, 192, 32, 32, 32), (4, 4, 4), 768, "channels_first"), ((128, 3, 224, 224), (16, 16), 768, "tokens")]:
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, shape[1], *k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        y = patchgemm.patch_embed(x, w, b, out_format=fmt)
    torch.cuda.synchronize()
