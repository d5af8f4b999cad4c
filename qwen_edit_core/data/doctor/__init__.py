"""The dataset doctor: finds the pairs that teach an edit LoRA nothing or the wrong thing (swapped, misaligned,
references out of order, unchanged, duplicated or leaked into the held-out pairs, masks off the edit, noisy
captions, odd sizes), each with its measured figure and a proposed fix; `fixes` applies the safe ones into a new
folder and `look` draws the worst pairs. One module per check family; `runner.diagnose` runs them all."""

from qwen_edit_core.data.doctor.findings import KINDS, DoctorReport, DoctorSettings, Finding
from qwen_edit_core.data.doctor.runner import DoctorRun, diagnose, doctor_folder

__all__ = ["KINDS", "DoctorReport", "DoctorRun", "DoctorSettings", "Finding", "diagnose", "doctor_folder"]
