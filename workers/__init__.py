# --quantize's methods (workers/quant.py implements them); here so the settings can name them without torch.
QUANTIZE_METHODS = ("int8", "int4")
