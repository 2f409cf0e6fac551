// comfyui-xdit: the text the xDiT nodes return as their UI output (ComfyUI's PreviewText: the backend's status, the
// layout a sampler ran), shown on the node itself once it has run, in a read-only box under its widgets.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const NODES = new Set(["XDiTBackend", "XDiTSampler", "XDiTSamplerAdvanced"]);
const WIDGET = "xdit_status";
const WAIT_TEXT = "$$node-text-preview"; // ComfyUI's progress text: what the node waited for before its first step

app.registerExtension({
  name: "comfyui-xdit.node-text",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text ?? []).join("\n");
      let widget = this.widgets?.find((w) => w.name === WIDGET);
      if (!widget) {
        widget = ComfyWidgets.STRING(this, WIDGET, ["STRING", { multiline: true }], app).widget;
        widget.inputEl.readOnly = true;
        widget.inputEl.style.opacity = 0.75;
        widget.serialize = false; // the node's saved widget values stay its own
      }
      widget.value = text;
      const waited = this.widgets.find((w) => w.name === WAIT_TEXT);
      if (waited && this.removeWidget) this.removeWidget(waited); // the wait is over: its last line would hide the text
      // room for the whole text (about 50 characters a line at the node's width, 12 px each), up to 10 lines
      const lines = text.split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / 50)), 0);
      const height = this.computeSize()[1] + 12 * Math.min(lines, 10);
      this.setSize([Math.max(this.size[0], 320), Math.max(this.size[1], height)]);
      app.graph.setDirtyCanvas(true, false);
    };
  },
});
