"""evaluate metric module folder (load it by path with evaluate.load); a package so installs ship it."""
