"""Model families: each architecture's description (`family.Family`) and, per family, a subpackage holding its
behaviour (`qwen_image/`: Qwen-Image-Edit, Edit-2509, Edit-2511; `qwen_image_21/`: Qwen-Image-2.1)."""

from qwen_edit_core.families.family import (DEFAULT, FAMILIES, QWEN_IMAGE, QWEN_IMAGE_21, REFERENCE_LAYOUTS, Family,
                                            MissingStage, Toy, family_of, family_of_cache_name, family_of_class,
                                            family_of_file, family_of_model, family_of_vae, register, unregister)

__all__ = ["DEFAULT", "FAMILIES", "QWEN_IMAGE", "QWEN_IMAGE_21", "REFERENCE_LAYOUTS", "Family", "MissingStage", "Toy",
           "family_of", "family_of_cache_name", "family_of_class", "family_of_file", "family_of_model", "family_of_vae",
           "register", "unregister"]
