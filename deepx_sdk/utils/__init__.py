"""deepx_sdk.utils: torch.utils's data loading (`deepx_sdk.utils.data`)."""
