"""Loaded at interpreter start in a child of ``replaydiff record``: arms the step recorder, then steps aside.

Another ``sitecustomize`` later on sys.path (a site's own) is still run, so that adding ours changes nothing else.
"""
import os
import sys

from _replaydiff_record_env import ENV_VAR  # beside this file, first on sys.path

if os.environ.get(ENV_VAR):
    try:
        from replaydiff.record.child_arming import install

        install()
    except KeyboardInterrupt:
        # Ctrl-C while the recorder loads (it imports torch), before the job's first line: end as Python ends on an
        # uncaught one (killed by SIGINT, exit 130 in a shell), not with "Fatal Python error: init_import_site" and
        # a traceback through this file
        import signal

        sys.stderr.write("KeyboardInterrupt\n")
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)  # where the signal did not end the process
    except Exception as exc:  # never stop the user's program from starting
        sys.stderr.write(f"replaydiff: step recording not armed: {exc}\n")

_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    if _p and os.path.abspath(_p) != _here and os.path.isfile(os.path.join(_p, "sitecustomize.py")):
        import importlib.util

        _spec = importlib.util.spec_from_file_location("_site_sitecustomize", os.path.join(_p, "sitecustomize.py"))
        if _spec and _spec.loader:
            try:
                _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
            except Exception as exc:
                sys.stderr.write(f"replaydiff: the site's sitecustomize failed: {exc}\n")
        break
