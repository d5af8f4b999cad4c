"""The 2025 Qwen-Image family (Edit, Edit-2509, Edit-2511): its behaviour beside the shared stages."""
