"""Writing a standalone repro of one recorded op (``replaydiff repro``): the script, its description and inputs."""
