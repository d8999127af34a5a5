"""An example task: a small convolutional image classifier (flax NNX) on images it generates."""
