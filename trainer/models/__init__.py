"""Where a run's model comes from: built-in models, Hugging Face models by path, models
built on the meta device and given their values module by module.

- builtin.py: MLP, SmallCNN, GPT, resnet18, the loss and metric (`conf/model/*`). Start here.
- build.py: the model and the data of a run, which size each other (`model_and_data`).
- lm.py: `model=hf` from local files; the files a run keeps of its model.
- materialize.py: `empty_weights()`, and values given module by module.
- weights.py: safetensors read slice by slice; compile.py: `train.compile=true`, layer by layer.
"""
