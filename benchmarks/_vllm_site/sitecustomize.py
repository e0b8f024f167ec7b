"""Run at start-up by every Python process of the vLLM peer (throughput.py's child_env puts this
folder on its PYTHONPATH; vLLM starts helper processes of its own, e.g. to inspect the model).

torchvision / torchaudio / torchcodec built for another torch fail on import ("operator
torchvision::nms does not exist", "Could not load this library"), and transformers and vLLM
import them whenever they are installed. Text models do not need them, so a broken one is marked
absent (importlib.util.find_spec then returns None) and the peer runs anyway.
"""
import importlib
import sys

for _name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        importlib.import_module(_name)
    except ImportError:
        pass  # not installed
    except Exception as _exc:  # noqa: BLE001 - whatever the broken build raises
        print(f"sitecustomize: {_name} does not import ({type(_exc).__name__}); hidden",
              file=sys.stderr)
        sys.modules[_name] = None  # type: ignore[assignment]
