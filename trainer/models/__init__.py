"""Where a run's model comes from: built-in models, Hugging Face models by path, models
built on the meta device and given their values module by module.

- builtin.py: MLP, SmallCNN, GPT, GPT-MoE, resnet18 (`conf/model/*`). Start here.
- loss.py: the loss and metric; hooks.py: what a model may add to a training step (an
  extra loss term, an update after each step, figures to log), found once.
- build.py: the model and the data of a run, which size each other (`model_and_data`).
- lm.py: `model=hf` from local files; the files a run keeps of its model.
- materialize.py: `empty_weights()`, and values given module by module.
- weights.py: safetensors read slice by slice; compile.py: `train.compile=true`, layer by layer.
"""
