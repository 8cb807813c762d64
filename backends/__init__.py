"""Engine adapters: kvpool as the KV storage of SGLang HiCache and FastDeploy."""
