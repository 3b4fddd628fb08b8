"""Safe writing and reading of checkpoint folders, shared by the models, the converters and the training:
`atomic` (all-or-nothing folder writes with clean-up after kills), `integrity` (what a checkpoint's files must satisfy
before their tensors are used). Neither imports torch.distributed: the model code carries both into checkpoints."""
