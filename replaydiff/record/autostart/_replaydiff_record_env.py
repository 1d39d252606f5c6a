"""The environment variable `replaydiff record` sets in its child: its one definition.

It sits beside ``sitecustomize`` (first on the child's sys.path), which must read it before importing anything of
replaydiff (and torch) in every process that inherits the path; replaydiff imports it as
``replaydiff.record.autostart._replaydiff_record_env``.
"""
ENV_VAR = "REPLAYDIFF_RECORD"
