import os

# The adapters must never touch the network; force offline even if the caller's env says otherwise.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
