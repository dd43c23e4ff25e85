"""What every layer of the package shares, importing nothing else from it and no torch: the results layout and the
method-token grammar (:mod:`statereduce.common.layout`) and the typed settings of every configuration block
(:mod:`statereduce.common.settings`). Config validation (every dry run) reads both."""
